"""The CPU backend: fused C kernels, packed GEMMs and the dense decode mirror.

Registered as the ``cpu`` attention backend and the ``cpu_packed`` linear method
(``plugin.py``); ``auto`` selects both on CPU. Every kernel has a torch fallback, so the
backend also runs where no C compiler is found.
"""
