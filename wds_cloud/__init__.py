"""wds_cloud: feed deep-learning training from sharded WebDataset tars stored anywhere.

``import wds_cloud as wds`` runs code written for webdataset 1.0.2.  Importing
the package does no I/O and loads no plugin; plugins load on first use.
"""

__version__ = "0.1.0"


from . import errors, tenbin, transport, utils
from .autodecode import (
    Continue,
    Decoder,
    gzfilter,
    handle_extension,
    imagehandler,
    pytorch_weights_only,
    torch_audio,
    torch_loads,
    torch_video,
)
from .cache import LRUCleanup, pipe_cleaner
from .compat import FluidInterface, FluidWrapper, MixedDataset, WebDataset, WebLoader, from_spec
from .config import Settings
from .dataset.options import ReadOptions
from .errors import (
    AccessDeniedError,
    ConfigError,
    CorruptIndexError,
    CorruptShardError,
    CredentialsError,
    DecodingError,
    InexactResumeWarning,
    IntegrityError,
    MalformedDataError,
    MissingExtraError,
    NotResumableError,
    ObjectChangedError,
    PipeError,
    PluginConflictError,
    PluginError,
    RandomAccessError,
    SampleError,
    SecurityError,
    ShardNotFoundError,
    StateMismatchError,
    TransferError,
    UnknownSchemeError,
    WdsCloudError,
)
from .extradatasets import MockDataset, repeatedly, with_epoch, with_length
from .filters import (
    Cached,
    LMDBCached,
    associate,
    batched,
    decode,
    detshuffle,
    extract_keys,
    getfirst,
    info,
    map,
    map_dict,
    map_tuple,
    pipelinefilter,
    rename,
    rename_keys,
    rsample,
    select,
    shuffle,
    slice,
    to_tuple,
    transform_with,
    unbatched,
    xdecode,
)
from .gopen import gopen, gopen_schemes, reader
from .handlers import ignore_and_continue, ignore_and_stop, reraise_exception, warn_and_continue, warn_and_stop
from .index.dataset import ShardListDataset
from .interleaved import collate_interleaved, interleaved, interleaved_sample  # the module, then the function
from .io import hookimpl
from .loader.gpu import gpu_decode, to_device
from .mix import RandomMix, RoundRobin
from .pipeline import DataPipeline
from .resume import Resumable
from .resume.merge import merge_states
from .shardlists import (
    MultiShardSample,
    ResampledShards,
    SimpleShardList,
    non_empty,
    resampled,
    shardspec,
    single_node_only,
    split_by_node,
    split_by_worker,
)
from .stages import PipelineStage
from .tariterators import tarfile_samples, tarfile_to_samples
from .writer import ShardWriter, TarWriter, numpy_dumps, torch_dumps

__all__ = [
    "merge_states",
    "__version__",
    # pipeline
    "DataPipeline",
    "WebDataset",
    "ReadOptions",
    "WebLoader",
    "FluidInterface",
    "FluidWrapper",
    "PipelineStage",
    "MockDataset",
    "with_epoch",
    "with_length",
    "repeatedly",
    # shard lists
    "SimpleShardList",
    "ResampledShards",
    "MultiShardSample",
    "shardspec",
    "resampled",
    "non_empty",
    "single_node_only",
    "split_by_node",
    "split_by_worker",
    # tar
    "tarfile_samples",
    "tarfile_to_samples",
    # filters
    "associate",
    "batched",
    "unbatched",
    "decode",
    "xdecode",
    "detshuffle",
    "shuffle",
    "extract_keys",
    "getfirst",
    "info",
    "map",
    "map_dict",
    "map_tuple",
    "pipelinefilter",
    "rename",
    "rename_keys",
    "rsample",
    "select",
    "slice",
    "to_tuple",
    "transform_with",
    "Cached",
    "LMDBCached",
    # decoding
    "Continue",
    "Decoder",
    "DecodingError",
    "gzfilter",
    "handle_extension",
    "imagehandler",
    "torch_audio",
    "torch_video",
    "torch_loads",
    "pytorch_weights_only",
    # handlers
    "reraise_exception",
    "warn_and_continue",
    "ignore_and_continue",
    "warn_and_stop",
    "ignore_and_stop",
    # mixing
    "RandomMix",
    "RoundRobin",
    "from_spec",
    "MixedDataset",
    # interleaved image-text documents
    "interleaved",
    "interleaved_sample",
    "collate_interleaved",
    # feeding a GPU
    "gpu_decode",
    "to_device",
    # I/O
    "gopen",
    "gopen_schemes",
    "reader",
    "LRUCleanup",
    "pipe_cleaner",
    # writing
    "TarWriter",
    "ShardWriter",
    "numpy_dumps",
    "torch_dumps",
    # configuration and plugins
    "Settings",
    "hookimpl",
    "Resumable",
    # modules
    "errors",
    "tenbin",
    "transport",
    "utils",
    # errors
    "WdsCloudError",
    "ConfigError",
    "UnknownSchemeError",
    "CorruptShardError",
    "SampleError",
    "StateMismatchError",
    "NotResumableError",
    "InexactResumeWarning",
    "MissingExtraError",
    "PluginError",
    "PluginConflictError",
    "ShardNotFoundError",
    "SecurityError",
    "CredentialsError",
    "AccessDeniedError",
    "TransferError",
    "PipeError",
    "ObjectChangedError",
    "IntegrityError",
    "RandomAccessError",
    "MalformedDataError",
    "CorruptIndexError",
    "ShardListDataset",
]
