"""Helpers every layer may use: output folders, image conversion, precision (dtypes and autocast),
entry-point registries, the strict YAML/dataclass config loader, offload hooks. Imports nothing
else of the package.
"""
