"""What travels between machines and people: cache configs as validated JSON (`hub`: KVCacheConfig, publish,
kvcache_config.json), Hub-ready custom_generate folders (`export`), cache state files (`state`), calibrated FP8
scales (`calibration`), strict JSON reading (`json_files`). Nothing executable ever travels.

May import: caches and everything below them.
"""
