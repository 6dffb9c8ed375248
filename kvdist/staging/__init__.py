"""Host→device metadata copies that later host writes cannot corrupt (rule S3): the
persistent host-side block table (:class:`TableRows`), the ring of staging buffers
(:class:`Stager`) and the upload paths (CUDA, simulated, immediate)."""

from .rows import TableRows
from .stager import DEFAULT_SLOTS, Stager, StagingStats
from .uploads import CudaH2D, ImmediateH2D, SimH2D, upload_for


def make_stager(device, executor, *, slots: int = DEFAULT_SLOTS, protect: bool = True) -> Stager:
    """The stager for a cache on ``device`` whose tier copies run on ``executor``."""
    return Stager(upload_for(device, executor), slots=slots, protect=protect)


__all__ = ["DEFAULT_SLOTS", "CudaH2D", "ImmediateH2D", "SimH2D", "Stager", "StagingStats",
           "TableRows", "make_stager", "upload_for"]
