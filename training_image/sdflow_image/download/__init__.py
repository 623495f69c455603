"""The download job (SageMaker processing): LAION parquet -> img2dataset -> webdataset shards in S3."""
