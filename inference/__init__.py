"""inference: the engine — a Hugging Face model on the daemon's paged KV memory."""
