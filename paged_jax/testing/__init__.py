"""Hand-computable test models that travel through the real paged KV cache."""
