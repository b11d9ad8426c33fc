"""Applications built on the ooc library."""
