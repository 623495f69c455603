"""The local runtime: the template's AWS resources in a moto server, SageMaker jobs and endpoints as local processes."""
