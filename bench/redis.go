package main

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/pgfence/pgfence/internal/testing/pgserver"
)

// startRedis starts redis-server on loopback. Without durable it runs
// without persistence (no RDB snapshots, no AOF): the configuration people
// use for a lock server. With durable it appends every write to its AOF and
// fsyncs it before replying (appendonly yes, appendfsync always; writes of
// one event-loop turn share one fsync): the durable analogue of a lease
// table. The persistence the server reports (CONFIG GET) is returned as
// persistence.
func startRedis(ctx context.Context, durable bool) (c *child, addr, version, persistence string, err error) {
	bin, err := lookBin("redis-server")
	if err != nil {
		return nil, "", "", "", err
	}
	version = "Redis"
	for _, f := range strings.Fields(binVersion(bin, "--version")) {
		if v, ok := strings.CutPrefix(f, "v="); ok {
			version += " " + v
		}
	}
	dir, err := os.MkdirTemp("", "pgfence-bench-redis-*")
	if err != nil {
		return nil, "", "", "", err
	}
	port, err := pgserver.FreePort()
	if err != nil {
		_ = os.RemoveAll(dir)
		return nil, "", "", "", err
	}
	args := []string{"--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--save", "",
		"--daemonize", "no", "--dir", dir, "--protected-mode", "yes"}
	if durable {
		args = append(args, "--appendonly", "yes", "--appendfsync", "always")
	} else {
		args = append(args, "--appendonly", "no")
	}
	c, err = startChild("redis", dir, bin, args...)
	if err != nil {
		_ = os.RemoveAll(dir)
		return nil, "", "", "", err
	}
	addr = fmt.Sprintf("127.0.0.1:%d", port)
	err = c.waitReady(ctx, func(ctx context.Context) error {
		rdb := redis.NewClient(&redis.Options{Addr: addr})
		defer rdb.Close()
		if err := rdb.Ping(ctx).Err(); err != nil {
			return err
		}
		persistence, err = redisPersistence(ctx, rdb)
		return err
	})
	if err != nil {
		c.stop()
		return nil, "", "", "", err
	}
	want := "appendonly no"
	if durable {
		want = "appendonly yes, appendfsync always"
	}
	if !strings.HasPrefix(persistence, want) {
		c.stop()
		return nil, "", "", "", fmt.Errorf("redis-server reports %q, want %q", persistence, want)
	}
	return c, addr, version, persistence, nil
}

// redisPersistence describes the server's persistence from CONFIG GET, e.g.
// "appendonly yes, appendfsync always, save \"\"".
func redisPersistence(ctx context.Context, rdb *redis.Client) (string, error) {
	get := func(k string) (string, error) {
		m, err := rdb.ConfigGet(ctx, k).Result()
		if err != nil {
			return "", err
		}
		if v := m[k]; v != "" {
			return v, nil
		}
		return `""`, nil
	}
	aof, err := get("appendonly")
	if err != nil {
		return "", err
	}
	parts := []string{"appendonly " + aof}
	if aof == "yes" {
		fsync, err := get("appendfsync")
		if err != nil {
			return "", err
		}
		parts = append(parts, "appendfsync "+fsync)
	}
	save, err := get("save")
	if err != nil {
		return "", err
	}
	return strings.Join(append(parts, "save "+save), ", "), nil
}

// releaseScript deletes the key only if it still holds the caller's value,
// the usual single-instance Redis lock release.
var releaseScript = redis.NewScript(`if redis.call("get", KEYS[1]) == ARGV[1] then return redis.call("del", KEYS[1]) else return 0 end`)

var errNotHolder = errors.New("redis lock: value changed before release")

// redisVariant measures SET NX PX + scripted release cycles. On the hot key
// a refused SET is retried at once (no back-off): the best case for Redis.
// Every grant is checked by probe for mutual exclusion (Redis issues no
// token); on the hot key probe also records each acquire's wait.
func redisVariant(addr string, hot bool, clients int, probe *lockProbe) variant {
	name := "distinct keys"
	if hot {
		name = "one hot key"
	}
	return variant{name: name, clients: clients, probe: probe, run: func(ctx context.Context, dur time.Duration) (runResult, error) {
		rdb := redis.NewClient(&redis.Options{Addr: addr, PoolSize: clients, MinIdleConns: clients})
		defer rdb.Close()
		if err := releaseScript.Load(ctx, rdb).Err(); err != nil {
			return runResult{}, err
		}
		seed := rand.Uint64()
		pr := probe.start()
		return closedLoop(ctx, clients, dur, func(ctx context.Context, w, i int) error {
			key, slot := "pgfence-bench:hot", 0
			if !hot {
				key, slot = "pgfence-bench:lock:"+strconv.Itoa(w), w
			}
			val := strconv.FormatUint(seed, 36) + ":" + strconv.Itoa(w) + ":" + strconv.Itoa(i)
			st := pr.begin()
			for {
				ok, err := rdb.SetArgs(ctx, key, val, redis.SetArgs{Mode: "NX", TTL: 30 * time.Second}).Result()
				if err == nil && ok == "OK" {
					break
				}
				if err != nil && !errors.Is(err, redis.Nil) {
					return err
				}
				if ctx.Err() != nil {
					return ctx.Err()
				}
			}
			pr.granted(w, slot, noToken, st)
			pr.releasing(w, slot)
			n, err := releaseScript.EvalSha(ctx, rdb, []string{key}, val).Int()
			if err != nil {
				return err
			}
			if n != 1 {
				return errNotHolder
			}
			return nil
		})
	}}
}

const (
	scenP2 = "P2 Redis, no persistence: SET NX PX + Lua release"
	scenP3 = "P3 Redis, AOF fsync always: SET NX PX + Lua release"
)

// redisPeer is one of the two Redis configurations: P2 without persistence,
// P3 with every write fsynced to the AOF before the reply.
type redisPeer struct {
	id, scen, key string
	durable       bool
	addr          *string // where the bench keeps the server's address
}

func (b *bench) redisPeers() []redisPeer {
	return []redisPeer{
		{id: "P2", scen: scenP2, key: keyP2, addr: &b.redisAddr},
		{id: "P3", scen: scenP3, key: keyP3, durable: true, addr: &b.redisAOFAddr},
	}
}

// startRedisPeer starts a redis-server for P2 and one for P3 when wanted
// and installed; otherwise it records why they are not measured. stop is
// never nil.
func (b *bench) startRedisPeer(ctx context.Context) (stop func()) {
	var stops []func()
	for _, p := range b.redisPeers() {
		switch {
		case !b.want(p.id):
			continue
		case b.cfg.noRedis:
			b.add(notMeasured(p.scen, "", 0, "cycles/s", "disabled with --no-redis"))
			continue
		}
		c, addr, version, persistence, err := startRedis(ctx, p.durable)
		if err != nil {
			b.add(notMeasured(p.scen, "", 0, "cycles/s", "redis: "+err.Error()+" (apt-get install redis-server)"))
			continue
		}
		*p.addr = addr
		b.mach.Redis = version
		if p.durable {
			b.mach.RedisDurable = persistence
		}
		b.progress("%s (%s) listening on %s", version, persistence, addr)
		stops = append(stops, c.stop)
	}
	return func() {
		for _, s := range stops {
			s()
		}
	}
}

// redisVariants returns the variants of every Redis peer that runs (P2, P3)
// with the rows they add.
func (b *bench) redisVariants(hot bool, clients int) []variant {
	var vs []variant
	for _, p := range b.redisPeers() {
		if *p.addr == "" {
			continue
		}
		vs = append(vs, b.redisPeerVariant(p, hot, clients))
	}
	return vs
}

func (b *bench) redisPeerVariant(p redisPeer, hot bool, clients int) variant {
	k, name, names := keyDistinct, "distinct keys", clients
	if hot {
		k, name, names = keyHot, "one hot key", 1
	}
	probe := newLockProbe(p.scen, name, clients, names, false, hot)
	v := redisVariant(*p.addr, hot, clients, probe)
	v.emit = func(s series) {
		b.add(rateRow(p.scen, v.name, clients, "cycles/s", s))
		b.keep(p.key, k, clients, s.rates)
		if hot {
			b.keep(keyWaitP99(p.key), keyHot, clients, probe.cont.waitP99)
			b.addContentionRows(p.scen, v.name, clients, &probe.cont, false)
		}
		if clients == 1 && !hot {
			b.memRow(p.id+" Redis lock+release", s)
		}
	}
	return v
}
