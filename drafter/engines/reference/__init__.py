"""Our own inference engine: `ReferenceEngine` (its command line, engine.py), the server it
launches (`python -m drafter.engines.reference.reference_server`, with its HTTP layer in
reference_http.py) and the speculative decoder both it and the export judge run (speculative.py).
Importing this package imports no torch: the server and the decoder load it themselves."""
from drafter.engines.reference.engine import ReferenceEngine

__all__ = ["ReferenceEngine"]
