"""Config schemas, composition and validation."""
