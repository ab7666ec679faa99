"""Reader and writer of `.infernix` artifacts: a small header, a JSON directory and an aligned
payload, memory-mapped and handed out as zero-copy numpy views (format in docs/artifact.md)."""
