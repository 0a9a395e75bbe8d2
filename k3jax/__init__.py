"""k3jax: KDA math and the Kimi Linear / K3 model in pure JAX."""
