"""Multi-device KDA: context parallelism (KCP)."""
