"""The storage engine: saved-tensor packers (plain, compressed, offloaded) and their accounting."""
