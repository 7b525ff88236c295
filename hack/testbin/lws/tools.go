//go:build tools

// Package tools pins the LeaderWorkerSet controller (its cmd/main.go package) that
// hack/testbin/build.sh compiles.
package tools

import _ "sigs.k8s.io/lws/cmd"
