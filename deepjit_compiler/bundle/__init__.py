"""The deployable bundle: the build's files and manifest fields in, a verified folder and its
reproducible .tar.gz out; `read_bundle` gives the typed read side."""
