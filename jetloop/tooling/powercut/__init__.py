"""Power cuts for the fault harness: a disk that loses what was not fsynced.

- ``lazyfs``  a FUSE passthrough filesystem (after Jepsen's LazyFS) that keeps written data
              volatile until the file is fsynced; ``LazyFS.cut()`` drops it, as a power cut
              does, under a nats-server's JetStream store
"""
