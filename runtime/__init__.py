"""Engine runtime for LANTERN++: trees, acceptance rules, backends and the decoding loop.

Imports numpy only; a backend's own package is imported when that backend is asked for.
"""
