"""The package is layered: each module imports only from lower layers or its own group, and no
modules import each other in a loop, inside a group included.

    0 utils      unclip/utils/, unclip/_compat.py: files, images, precision, registries, configs
    1 io         unclip/io/          safetensors weights, Hub, model cards
    2 diffusion  unclip/diffusion/   noise schedules, the training loss, the denoising loop, VLB
    3 nets       unclip/nets/        CLIP, priors, decoder, upsamplers, blocks, LoRA layers, configs
    4 sampling   unclip/sampling/    per-stage settings and samplers, AR sampling, candidate choice
    5 pipeline   unclip/pipeline/    UnCLIPPipeline, folders, editing, offload, LoRA, outputs
    6 facade     unclip/__init__.py  the public names, imported on first use
    7 interop    unclip/interop/     diffusers/Karlo folders, transformers CLIP
      shapes     unclip/shapes/{world,captions,contrasts,regions,detector}.py: the procedural world,
                 its captions, rerank contrasts and region scorers, and its pixel evaluator
    8 train      unclip/train/       the training loop, stage tasks, data sources, embeddings, plan
      eval       unclip/eval/        metrics and the evaluation job
    9 tools      unclip/shapes/ (the rest): the shapes CLIP trainer, held-out evaluation, recipe
      demo       unclip/demo/        the web demo
   10 cli        unclip/cli/         argument parsing only

Imports inside functions count, and so do imports under ``if TYPE_CHECKING:``. The interop folder
readers and the shapes contrasts reach the core through entry points, not through an import; the
old import paths of moved names resolve by name at run time (:mod:`unclip._compat`).
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "unclip"

# group -> layer; a module of group g may import group h iff layer(h) < layer(g) or h == g
LAYERS = {
    "utils": 0,
    "io": 1,
    "diffusion": 2,
    "nets": 3,
    "sampling": 4,
    "pipeline": 5,
    "facade": 6,
    "interop": 7,
    "shapes": 7,
    "train": 8,
    "eval": 8,
    "tools": 9,
    "demo": 9,
    "cli": 10,
}
SUBPACKAGES = {"utils", "io", "diffusion", "nets", "sampling", "pipeline", "interop", "train"}
SUBPACKAGES |= {"eval", "demo", "cli"}
SHAPES_DATA = {
    "unclip.shapes",
    "unclip.shapes.world",
    "unclip.shapes.captions",
    "unclip.shapes.contrasts",
    "unclip.shapes.regions",
    "unclip.shapes.detector",
}


def group_of(module: str) -> str:
    parts = module.split(".")
    if module == "unclip":
        return "facade"
    sub = parts[1]
    if sub == "_compat":
        return "utils"
    if sub in SUBPACKAGES:
        return sub
    if sub == "shapes":
        return "shapes" if module in SHAPES_DATA else "tools"
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
            # `from unclip.x import y` may name a submodule y: then y is meant, not unclip.x
            named = {f"{target}.{a.name}" for a in node.names}
            found.update(module_targets({target} | named))
    return {m for m in found if m == "unclip" or m.startswith("unclip.")}


def known(module: str) -> bool:
    path = ROOT.parent / Path(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def module_targets(targets: set[str]) -> set[str]:
    """The modules among one statement's ``targets``: `from unclip.shapes import world` names both
    the package and the module (the module is meant); `from unclip.x import name` names no module
    ``unclip.x.name``."""
    return {
        m
        for m in targets
        if (m == "unclip" or known(m))
        and not any(o.startswith(m + ".") and known(o) for o in targets)
    }


def import_graph(files: dict[str, str]) -> dict[str, set[str]]:
    """module -> the package modules it imports (anywhere in its source)."""
    graph = {}
    for name, source in files.items():
        module = name.removesuffix(".__init__")
        found = imported_modules(source, module, name.endswith(".__init__"))
        graph[module] = found - {module}
    return graph


def cycles(files: dict[str, str]) -> list[list[str]]:
    """Every set of modules that import each other in a loop (Tarjan's strongly connected
    components of more than one module), sorted."""
    graph = import_graph(files)
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def violations(files: dict[str, str]) -> list[str]:
    """``files``: module name -> source (``is_package`` when the name ends in ``.__init__``)."""
    bad = []
    for name, source in files.items():
        is_package = name.endswith(".__init__")
        module = name.removesuffix(".__init__")
        mine = group_of(module)
        targets = imported_modules(source, module, is_package)
        for target in sorted(targets):
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


def test_no_modules_import_each_other_in_a_loop():
    assert cycles(package_sources()) == []


@pytest.mark.parametrize(
    "module, line, loop",
    [
        (
            "unclip.sampling.settings",
            "from unclip.sampling.stages import sample_prior",
            {"unclip.sampling.settings", "unclip.sampling.stages"},
        ),
        (
            "unclip.nets.clip_weights",
            "    from unclip.nets.clip import CLIP  # inside a function",
            {"unclip.nets.clip", "unclip.nets.clip_weights"},
        ),
        (
            "unclip.train.prior_batches",
            "from unclip.train import prior",
            {"unclip.train.prior_batches", "unclip.train.prior"},
        ),
    ],
)
def test_the_rule_catches_a_loop_inside_a_group(module, line, loop):
    sources = package_sources()
    sources[module] = sources[module] + "\n\ndef _f():\n" + ("    " + line.strip()) + "\n"
    assert violations(sources) == []  # same group: the layer rule alone would let it pass
    found = cycles(sources)
    assert len(found) == 1 and set(found[0]) >= loop, found


def test_every_module_has_a_layer():
    for name in package_sources():
        group_of(name.removesuffix(".__init__"))  # raises for a module outside every layer


@pytest.mark.parametrize(
    "module, line",
    [
        ("unclip.pipeline.pipeline", "from unclip.interop.diffusers import load_diffusers_unclip"),
        (
            "unclip.nets.decoder",
            "    from unclip.train.loop import TrainingRun  # inside a function",
        ),
        ("unclip.nets.clip", "from ..shapes import world"),
        ("unclip.nets.prior", "from unclip.sampling.stages import sample_prior"),
        ("unclip.sampling.candidates", "from unclip.pipeline.pipeline import UnCLIPPipeline"),
        ("unclip.io.weights", "from unclip.nets.clip import CLIP"),
        ("unclip.utils.images", "from unclip.io import hub"),
        ("unclip.diffusion.loop", "from unclip import UnCLIPPipeline"),
        ("unclip.sampling.scorers", "from unclip.shapes.world import contrast_pairs"),
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

    from unclip.utils.registry import _EntryPointCallable

    ep = EntryPoint(
        "x", "unclip.shapes.contrasts:contrast_pairs_regions", "unclip.rerank_contrasts"
    )
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


def test_every_old_import_path_resolves_once_with_a_warning():
    """Names that moved into the sub-packages keep their old import path: each entry of the alias
    table resolves to the object where it lives now, with one FutureWarning naming the new path
    (not again for the same name)."""
    import importlib
    import warnings

    from unclip import _compat

    checked = 0
    for old, homes in _compat.MOVED.items():
        module = importlib.import_module(old)
        for new, names in homes.items():
            for name in names:
                with warnings.catch_warnings(record=True) as seen:
                    warnings.simplefilter("always")
                    _compat._warned.discard((old, name))
                    value = getattr(module, name)
                    again = getattr(module, name)
                assert value is again is getattr(importlib.import_module(new), name), (old, name)
                moved = [w for w in seen if issubclass(w.category, FutureWarning)]
                assert len(moved) == 1 and f"{new}.{name}" in str(moved[0].message), (old, name)
                checked += 1
    assert checked > 250  # the whole table was read
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        importlib.import_module("unclip.config").no_such_name  # noqa: B018
