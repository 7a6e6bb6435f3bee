"""The OpenAI-compatible HTTP layer over the engine: protocol, services, routes, the app (one error map)."""
