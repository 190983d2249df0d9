"""The engine: ``LLMEngine`` (add_request, step, abort), its async wrapper and request processing."""
