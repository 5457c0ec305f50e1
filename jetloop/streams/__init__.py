"""Everything that talks to NATS: topology, state bucket, blobs, history, publishing."""
