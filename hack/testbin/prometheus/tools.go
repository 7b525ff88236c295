//go:build tools

// Package tools pins the promtool CLI that hack/testbin/build.sh compiles.
package tools

import _ "github.com/prometheus/prometheus/cmd/promtool"
