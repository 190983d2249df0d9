"""The OpenAI-compatible server: routes, protocol models, the Realtime WebSocket, streaming and metrics."""
