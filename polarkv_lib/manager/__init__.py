"""The manager: metadata, placement, leases and node liveness. It never touches KV bytes."""
