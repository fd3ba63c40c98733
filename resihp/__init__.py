"""ResiHP shared core: wire schemas, Redis key names, topology and the pipeline engine.

Services (collector, detector, scheduler, dashboard, trainer) import this
package and never each other.
"""

__version__ = "0.1.0"
