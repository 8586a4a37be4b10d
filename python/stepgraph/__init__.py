"""StepGraph from Python: a thin ctypes binding over the engine's C API.

The binding itself (layers, steps, tensors) arrives with the C API; today the
package finds the native library and reports errors the way the binding will.
"""

from stepgraph._library import StepGraphError, library_path

__version__ = "0.1.0"
__all__ = ["StepGraphError", "library_path", "__version__"]
