"""Weight sync from a trainer: `tensor_bucket` (upstream's FlattenedTensorBucket, the
`flattened_bucket` load format of /update_weights_from_tensor)."""
