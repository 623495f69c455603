"""The local SageMaker: jobs and endpoints run as processes, and the SageMaker API patches."""
