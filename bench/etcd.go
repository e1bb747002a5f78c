package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
	"go.uber.org/zap"

	"github.com/pgfence/pgfence/internal/testing/pgserver"
)

// startEtcd starts a single-member etcd on loopback with its default
// durability (the WAL is fsynced on every commit) in a temporary directory.
func startEtcd(ctx context.Context) (*child, *clientv3.Client, string, error) {
	bin, err := lookBin("etcd")
	if err != nil {
		return nil, nil, "", err
	}
	version := strings.Replace(binVersion(bin, "--version"), "etcd Version:", "etcd", 1)
	dir, err := os.MkdirTemp("", "pgfence-bench-etcd-*")
	if err != nil {
		return nil, nil, "", err
	}
	cport, err := pgserver.FreePort()
	if err != nil {
		return nil, nil, "", err
	}
	pport, err := pgserver.FreePort()
	if err != nil {
		return nil, nil, "", err
	}
	curl := fmt.Sprintf("http://127.0.0.1:%d", cport)
	purl := fmt.Sprintf("http://127.0.0.1:%d", pport)
	c, err := startChild("etcd", dir, bin,
		"--name", "bench",
		"--data-dir", filepath.Join(dir, "data"),
		"--listen-client-urls", curl, "--advertise-client-urls", curl,
		"--listen-peer-urls", purl, "--initial-advertise-peer-urls", purl,
		"--initial-cluster", "bench="+purl,
		"--log-level", "warn")
	if err != nil {
		_ = os.RemoveAll(dir)
		return nil, nil, "", err
	}
	cli, err := clientv3.New(clientv3.Config{
		Endpoints:   []string{curl},
		DialTimeout: 5 * time.Second,
		Logger:      zap.NewNop(),
	})
	if err != nil {
		c.stop()
		return nil, nil, "", err
	}
	err = c.waitReady(ctx, func(ctx context.Context) error {
		_, err := cli.Put(ctx, "/pgfence-bench/ready", "1")
		return err
	})
	if err != nil {
		cli.Close()
		c.stop()
		return nil, nil, "", err
	}
	return c, cli, version, nil
}

// etcdVariant measures concurrency.Mutex Lock+Unlock cycles, each client with
// its own session (lease); hot makes every client lock the same key. Every
// grant is checked by probe, with the revision of the Lock's response header
// as the token: it is at least the revision of the waiter's own key and
// beyond the previous holder's delete, so it increases with every grant of
// the key.
func etcdVariant(cli *clientv3.Client, hot bool, clients int, probe *lockProbe) variant {
	name := "distinct keys"
	if hot {
		name = "one hot key"
	}
	return variant{name: name, clients: clients, probe: probe, run: func(ctx context.Context, dur time.Duration) (runResult, error) {
		sessions := make([]*concurrency.Session, clients)
		mutexes := make([]*concurrency.Mutex, clients)
		defer func() {
			for _, s := range sessions {
				if s != nil {
					_ = s.Close()
				}
			}
		}()
		for w := range clients {
			s, err := concurrency.NewSession(cli, concurrency.WithTTL(30), concurrency.WithContext(ctx))
			if err != nil {
				return runResult{}, err
			}
			sessions[w] = s
			key := "/pgfence-bench/hot"
			if !hot {
				key = fmt.Sprintf("/pgfence-bench/lock/%d", w)
			}
			mutexes[w] = concurrency.NewMutex(s, key)
		}
		pr := probe.start()
		return closedLoop(ctx, clients, dur, func(ctx context.Context, w, i int) error {
			m := mutexes[w]
			slot := w
			if hot {
				slot = 0
			}
			st := pr.begin()
			if err := m.Lock(ctx); err != nil {
				return err
			}
			pr.granted(w, slot, m.Header().Revision, st)
			pr.releasing(w, slot)
			return m.Unlock(ctx)
		})
	}}
}

const scenP1 = "P1 etcd Mutex Lock+Unlock"

// startEtcdPeer starts etcd for P1 when wanted and installed; otherwise it
// records why P1 is not measured. The returned stop is never nil.
func (b *bench) startEtcdPeer(ctx context.Context) (stop func()) {
	switch {
	case !b.want("P1"):
		return func() {}
	case b.cfg.noEtcd:
		b.add(notMeasured(scenP1, "", 0, "cycles/s", "disabled with --no-etcd"))
		return func() {}
	}
	c, cli, version, err := startEtcd(ctx)
	if err != nil {
		b.add(notMeasured(scenP1, "", 0, "cycles/s", "etcd: "+err.Error()+" (apt-get install etcd-server)"))
		return func() {}
	}
	b.etcd = cli
	b.mach.Etcd = version
	b.progress("%s listening on loopback", version)
	return func() { cli.Close(); c.stop() }
}

// p1Variant is etcdVariant with the rows it adds.
func (b *bench) p1Variant(hot bool, clients int) variant {
	k, name, names := keyDistinct, "distinct keys", clients
	if hot {
		k, name, names = keyHot, "one hot key", 1
	}
	probe := newLockProbe(scenP1, name, clients, names, true, hot)
	v := etcdVariant(b.etcd, hot, clients, probe)
	v.emit = func(s series) {
		b.add(rateRow(scenP1, v.name, clients, "cycles/s", s))
		b.keep(keyP1, k, clients, s.rates)
		if hot {
			b.addContentionRows(scenP1, v.name, clients, &probe.cont, false)
		}
		if clients == 1 && !hot {
			b.memRow("P1 etcd Lock+Unlock", s)
		}
	}
	return v
}
