"""Entry points: the ``LLM`` class, the ``encdec`` command line and the OpenAI-compatible server (``openai/``)."""
