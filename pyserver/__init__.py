"""streambatch: gRPC LLM serving with a C++ batch queue over vLLM's engine step loop."""

from __future__ import annotations

__version__ = "0.1.0"
