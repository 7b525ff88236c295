//go:build tools

// Package tools pins the helm CLI that hack/testbin/build.sh compiles.
package tools

import _ "helm.sh/helm/v3/cmd/helm"
