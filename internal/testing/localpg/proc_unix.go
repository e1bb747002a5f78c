//go:build unix

package localpg

import (
	"errors"
	"fmt"
	"os"
	"os/user"
	"strconv"
	"syscall"
)

const supported = true

// owner is the unprivileged user a cluster runs as when this process is root.
type owner struct{ uid, gid uint32 }

// unprivilegedOwner returns nil when this process is not root. As root, it
// returns the "postgres" user (else "nobody") and hands dirs to that user.
func unprivilegedOwner(dirs ...string) (*owner, error) {
	if os.Geteuid() != 0 {
		return nil, nil
	}
	var o *owner
	for _, name := range []string{"postgres", "nobody"} {
		u, err := user.Lookup(name)
		if err != nil {
			continue
		}
		uid, err1 := strconv.ParseUint(u.Uid, 10, 32)
		gid, err2 := strconv.ParseUint(u.Gid, 10, 32)
		if err1 != nil || err2 != nil {
			continue
		}
		o = &owner{uid: uint32(uid), gid: uint32(gid)}
		break
	}
	if o == nil {
		return nil, ErrNoUnprivilegedUser
	}
	for _, d := range dirs {
		if err := os.Chown(d, int(o.uid), int(o.gid)); err != nil {
			return nil, fmt.Errorf("localpg: %w", err)
		}
	}
	// The cluster's user must be able to enter the top directory.
	if len(dirs) > 0 {
		if err := os.Chmod(dirs[0], 0o755); err != nil {
			return nil, fmt.Errorf("localpg: %w", err)
		}
	}
	return o, nil
}

// procAttr runs a child as o (when set). The postmaster (server) gets a
// process group of its own, so a terminal's Ctrl-C reaches only this process,
// which then stops the server in order; on Linux it also gets a parent-death
// signal.
func procAttr(o *owner, server bool) *syscall.SysProcAttr {
	a := &syscall.SysProcAttr{}
	if o != nil {
		a.Credential = &syscall.Credential{Uid: o.uid, Gid: o.gid, NoSetGroups: true}
	}
	if server {
		a.Setpgid = true
		setParentDeathSignal(a)
	}
	return a
}

// processGone reports whether no process has the id pid.
func processGone(pid int) bool {
	return errors.Is(syscall.Kill(pid, 0), syscall.ESRCH)
}
