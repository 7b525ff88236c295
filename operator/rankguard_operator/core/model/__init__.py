"""The model: what it is made of as far as GPU memory is concerned (`shape`, `quantization`,
`weights` per rank), read from a config.json (`hf_config`), the shipped catalog (`catalog`) or the
checkpoint's own headers (`checkpoint`), and where a service's shape comes from, once per pass
(`resolve`)."""
