"""Host-side serving: page pool, prefix cache, scheduler, engine, server, fleet."""
