"""Reading tar members, grouping them into samples, and writing tar files: the map of the package.

From the bytes of a shard to its samples, lowest first:

- :mod:`~wds_cloud.tar.format`: every fact of a tar header, read and written, stated once (fields, checksum,
  type flags, PAX records); the fast path's check of a plain member (``plain_header``) and the general reader's
  (``number``, ``checksum_ok``).
- :mod:`~wds_cloud.tar.decompress`: gzip, bz2, xz and zstd, named by a stream's first bytes and unwrapped.
- :mod:`~wds_cloud.tar.buffers`: the bytes a reader parses, streamed (a chunk at a time into one reused
  buffer) or mapped (a window at a time of a local file's mapping), asked for more once per chunk or window.
- :mod:`~wds_cloud.tar.table`: member tables kept per file (a second pass reads no header), and the process's
  cache of them.
- :mod:`~wds_cloud.tar.runs`: the fast path, runs of plain members (one header loop, or a kept table).
- :mod:`~wds_cloud.tar.members`: ``TarMembers``, a shard's members: the runs, and the general reader for
  everything else (long names, PAX records, other types, damage).
- :mod:`~wds_cloud.tar.grouping`: the key rules, ``SamplePosition``, and ``group``, the one grouping kernel
  over any runs; ``shard_samples`` reads and groups one shard.
- :mod:`~wds_cloud.tar.samples`: webdataset's stages (``url_opener``, ``tar_file_expander``,
  ``group_by_keys``), grouping with the same kernel.
- :mod:`~wds_cloud.tar.shardreader`: ``TarSamples``, the resumable shard reader stage of a pipeline.
- :mod:`~wds_cloud.tar.write`: writing members, fast and reproducibly, optionally compressed.
"""
