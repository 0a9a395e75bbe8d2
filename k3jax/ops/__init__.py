"""Pure-JAX KDA references: recurrent, chunked, segment algebra, decode, short conv."""
