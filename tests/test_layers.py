"""The package is layered: each module imports only from lower layers or its own group.

    0 core      unclip/*.py: configs, CLIP, prior, decoder, diffusion, pipeline, folders, images
    1 interop   unclip/interop/       diffusers/Karlo folders, transformers CLIP
      shapes    unclip/shapes/{world,detector}.py: the procedural dataset and its pixel evaluator
    2 train     unclip/train/         the training loop, stage tasks, data sources, embeddings
      eval      unclip/eval/          metrics and the evaluation job
    3 tools     unclip/shapes/ (the rest): the shapes CLIP trainer, held-out evaluation, finalize
    4 cli       unclip/cli/           argument parsing only

Imports inside functions count. The package facade ``unclip/__init__.py`` is core: it names core
classes only (imported on first use), and the interop folder readers reach
``UnCLIPPipeline.from_pretrained`` through entry points, not through an import.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "unclip"

# group -> layer; a module of group g may import group h iff layer(h) < layer(g) or h == g
LAYERS = {
    "core": 0,
    "interop": 1,
    "shapes": 1,
    "train": 2,
    "eval": 2,
    "tools": 3,
    "cli": 4,
}
SHAPES_DATA = {"unclip.shapes.world", "unclip.shapes.detector", "unclip.shapes"}


def group_of(module: str) -> str:
    parts = module.split(".")
    if module == "unclip":
        return "core"  # the facade
    sub = parts[1]
    if sub in ("interop", "train", "eval", "cli"):
        return sub
    if sub == "shapes":
        return "shapes" if module in SHAPES_DATA else "tools"
    if len(parts) == 2:
        return "core"
    raise ValueError(f"module {module} is in no layer; add its package to tests/test_layers.py")


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(source: str, module: str, is_package: bool) -> set[str]:
    """Every ``unclip.*`` module that ``source`` imports, at top level or inside functions."""
    found = set()
    package = module if is_package else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            # `from unclip.x import y` may name a submodule y
            found.update(f"{target}.{a.name}" for a in node.names)
    return {m for m in found if m == "unclip" or m.startswith("unclip.")}


def known(module: str) -> bool:
    path = ROOT.parent / Path(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def violations(files: dict[str, str]) -> list[str]:
    """``files``: module name -> source (``is_package`` when the name ends in ``.__init__``)."""
    bad = []
    for name, source in files.items():
        is_package = name.endswith(".__init__")
        module = name.removesuffix(".__init__")
        mine = group_of(module)
        targets = imported_modules(source, module, is_package)
        # `from unclip.shapes import world` names both; report the module, not its package too
        targets = {
            m
            for m in targets
            if m == "unclip" or not any(o.startswith(m + ".") and known(o) for o in targets)
        }
        for target in sorted(targets):
            if target != "unclip" and not known(target):
                continue  # `from unclip.x import name`: name is not a module
            theirs = group_of(target)
            if theirs != mine and LAYERS[theirs] >= LAYERS[mine]:
                bad.append(
                    f"{module} ({mine}, layer {LAYERS[mine]}) imports {target} "
                    f"({theirs}, layer {LAYERS[theirs]})"
                )
    return bad


def package_sources() -> dict[str, str]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        name = module_name(path)
        out[name + (".__init__" if path.name == "__init__.py" else "")] = path.read_text()
    return out


def test_every_module_imports_only_lower_layers():
    sources = package_sources()
    assert len(sources) > 25  # the whole package was found
    assert violations(sources) == []


def test_every_module_has_a_layer():
    for name in package_sources():
        group_of(name.removesuffix(".__init__"))  # raises for a module outside every layer


@pytest.mark.parametrize(
    "module, line",
    [
        ("unclip.pipeline", "from unclip.interop.diffusers import load_diffusers_unclip"),
        ("unclip.decoder", "    from unclip.train.loop import TrainingRun  # inside a function"),
        ("unclip.clip", "from .shapes import world"),
        ("unclip.train.loop", "import unclip.eval.metrics"),
        ("unclip.shapes.world", "from unclip.train.data.loader import make_batches"),
        ("unclip.eval.metrics", "from unclip.cli import generate"),
        ("unclip", "import unclip.interop"),
        ("unclip", "    from unclip.train.loop import TrainLoop  # e.g. under TYPE_CHECKING"),
        ("unclip.train.embed", "from unclip.eval.metrics import GaussianStats"),
    ],
)
def test_the_rule_catches_an_upward_import(module, line):
    sources = package_sources()
    key = module if module in sources else module + ".__init__"
    sources[key] = sources[key] + "\n\ndef _f():\n" + ("    " + line.strip()) + "\n"
    found = violations(sources)
    assert len(found) == 1 and found[0].startswith(module), found


def test_an_entry_point_callable_imports_on_call_or_attribute_lookup_only():
    """The registries' entry-point callables stay unimported when copied or probed for private
    names (copy, pickle and display hooks do that), and import on the first call or on the lookup
    of an attribute the callable carries (a rerank contrast's ``regions``)."""
    import copy
    from importlib.metadata import EntryPoint

    from unclip.registry import _EntryPointCallable

    ep = EntryPoint("x", "unclip.shapes.world:contrast_pairs_regions", "unclip.rerank_contrasts")
    lazy = _EntryPointCallable(ep)
    copied = copy.copy(lazy)
    assert not hasattr(lazy, "_repr_html_") and not hasattr(lazy, "__wrapped__")
    assert lazy._fn is None and copied._fn is None
    assert [p.axis for p in lazy.regions("a red circle above a blue square")] == ["y", "y"]
    assert lazy._fn is not None
    with pytest.raises(AttributeError):
        _ = lazy.no_such_attribute
    called = _EntryPointCallable(ep)
    assert called("a yellow square") == [] and called._fn is not None
