package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"
)

// child is a server process this run started (etcd, redis-server). It is
// started in its own process group with the parent-death signal set, so it
// does not outlive the bench even when the bench is killed.
type child struct {
	name string
	cmd  *exec.Cmd
	dir  string
	done chan struct{}
}

func startChild(name, dir, bin string, args ...string) (*child, error) {
	logf, err := os.Create(filepath.Join(dir, name+".log"))
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(bin, args...)
	cmd.Dir = dir
	cmd.Stdout = logf
	cmd.Stderr = logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	c := &child{name: name, cmd: cmd, dir: dir, done: make(chan struct{})}
	go func() {
		_ = cmd.Wait()
		logf.Close()
		close(c.done)
	}()
	return c, nil
}

func (c *child) exited() bool {
	select {
	case <-c.done:
		return true
	default:
		return false
	}
}

func (c *child) logTail() string {
	b, _ := os.ReadFile(filepath.Join(c.dir, c.name+".log"))
	lines := bytes.Split(bytes.TrimSpace(b), []byte("\n"))
	if len(lines) > 5 {
		lines = lines[len(lines)-5:]
	}
	return string(bytes.Join(lines, []byte(" | ")))
}

// stop terminates the process and removes its directory.
func (c *child) stop() {
	if c == nil {
		return
	}
	if !c.exited() {
		_ = c.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-c.done:
		case <-time.After(10 * time.Second):
			_ = c.cmd.Process.Kill()
			<-c.done
		}
	}
	_ = os.RemoveAll(c.dir)
}

// waitReady polls ready until it succeeds, the process exits or 30 s pass.
func (c *child) waitReady(ctx context.Context, ready func(context.Context) error) error {
	deadline := time.Now().Add(30 * time.Second)
	for {
		if c.exited() {
			return fmt.Errorf("%s exited during start-up: %s", c.name, c.logTail())
		}
		pctx, cancel := context.WithTimeout(ctx, time.Second)
		err := ready(pctx)
		cancel()
		if err == nil {
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s not ready after 30s: %v: %s", c.name, err, c.logTail())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// lookBin finds a binary on PATH or in the usual Debian directories.
func lookBin(name string) (string, error) {
	if p, err := exec.LookPath(name); err == nil {
		return p, nil
	}
	for _, d := range []string{"/usr/bin", "/usr/sbin", "/usr/local/bin"} {
		p := filepath.Join(d, name)
		if st, err := os.Stat(p); err == nil && !st.IsDir() {
			return p, nil
		}
	}
	return "", errors.New(name + " not installed")
}

func binVersion(bin string, args ...string) string {
	out, err := exec.Command(bin, args...).Output()
	if err != nil {
		return ""
	}
	return strings.TrimSpace(strings.SplitN(string(out), "\n", 2)[0])
}
