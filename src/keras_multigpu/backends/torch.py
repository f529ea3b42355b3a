"""The torch engine is not built yet: every entry point says so clearly."""

from keras_multigpu.backends._unsupported import unsupported

configure_cpu_devices = unsupported("torch", "configure_cpu_devices", quiet=True)
list_devices = unsupported("torch", "list_devices")
make_distribution = unsupported("torch", "make_distribution")
replicate = unsupported("torch", "replicate")
resident = unsupported("torch", "resident")
shard = unsupported("torch", "shard")
free_memory = unsupported("torch", "free_memory")
tag = unsupported("torch", "tag")
untag = unsupported("torch", "untag")
process_index = unsupported("torch", "process_index")
process_count = unsupported("torch", "process_count")
