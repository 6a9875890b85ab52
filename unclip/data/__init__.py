"""Data for unclip: the built-in procedural "shapes" world, image–caption pairs and embedding shards."""
