"""Exact mid-epoch resume: the state format and its checks, the counted RNG, the resumable
shuffle, refetching buffered samples, and the loader-side plumbing.

``Resumable`` (:mod:`wds_cloud.resume.protocol`) is what a stage implements to take part; that module's
docstring is also the map of this package (which module does what).
"""

from .protocol import BufferingStage, Resumable, SampleSource

__all__ = ["Resumable", "SampleSource", "BufferingStage"]
