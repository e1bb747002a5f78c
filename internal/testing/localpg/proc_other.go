//go:build !unix

package localpg

import "syscall"

const supported = false

type owner struct{}

func unprivilegedOwner(...string) (*owner, error) { return nil, nil }

func procAttr(*owner, bool) *syscall.SysProcAttr { return nil }

func processGone(int) bool { return false }
