module github.com/cudapool/cudapool

go 1.26.8

require (
	github.com/NVIDIA/go-nvml v0.13.0-1
	github.com/ebitengine/purego v0.11.3
	github.com/stretchr/testify v1.12.1
)

require go.yaml.in/yaml/v3 v3.0.5 // indirect
