"""Training recipes that ship with the package (``configs/shapes/recipe.sh`` uses these helpers)."""
