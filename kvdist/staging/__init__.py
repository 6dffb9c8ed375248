"""Host→device metadata copies that later host writes cannot corrupt (rule S3): the
persistent host-side block table (:class:`TableRows`), the ring of staging buffers
(:class:`Stager`) and the upload paths (CUDA, simulated, immediate) behind the
``Upload`` contract."""

from .rows import TableRows
from .stager import DEFAULT_SLOTS, Stager, StagingStats
from .uploads import CudaH2D, ImmediateH2D, SimH2D, Upload

__all__ = ["DEFAULT_SLOTS", "CudaH2D", "ImmediateH2D", "SimH2D", "Stager", "StagingStats",
           "TableRows", "Upload"]
