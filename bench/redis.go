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

	"github.com/pgfence/pgfence/internal/pgserver"
)

// startRedis starts redis-server on loopback without persistence (no RDB
// snapshots, no AOF): the configuration people use for a lock server.
func startRedis(ctx context.Context) (*child, string, string, error) {
	bin, err := lookBin("redis-server")
	if err != nil {
		return nil, "", "", err
	}
	version := "Redis"
	for _, f := range strings.Fields(binVersion(bin, "--version")) {
		if v, ok := strings.CutPrefix(f, "v="); ok {
			version += " " + v
		}
	}
	dir, err := os.MkdirTemp("", "pgfence-bench-redis-*")
	if err != nil {
		return nil, "", "", err
	}
	port, err := pgserver.FreePort()
	if err != nil {
		return nil, "", "", err
	}
	c, err := startChild("redis", dir, bin,
		"--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
		"--daemonize", "no", "--dir", dir, "--protected-mode", "yes")
	if err != nil {
		_ = os.RemoveAll(dir)
		return nil, "", "", err
	}
	addr := fmt.Sprintf("127.0.0.1:%d", port)
	err = c.waitReady(ctx, func(ctx context.Context) error {
		rdb := redis.NewClient(&redis.Options{Addr: addr})
		defer rdb.Close()
		return rdb.Ping(ctx).Err()
	})
	if err != nil {
		c.stop()
		return nil, "", "", err
	}
	return c, addr, version, nil
}

// releaseScript deletes the key only if it still holds the caller's value,
// the usual single-instance Redis lock release.
var releaseScript = redis.NewScript(`if redis.call("get", KEYS[1]) == ARGV[1] then return redis.call("del", KEYS[1]) else return 0 end`)

var errNotHolder = errors.New("redis lock: value changed before release")

// redisVariant measures SET NX PX + scripted release cycles. On the hot key
// a refused SET is retried at once (no back-off): the best case for Redis.
func redisVariant(addr string, hot bool, clients int) variant {
	name := "distinct keys"
	if hot {
		name = "one hot key"
	}
	return variant{name: name, clients: clients, run: func(ctx context.Context, dur time.Duration) (runResult, error) {
		rdb := redis.NewClient(&redis.Options{Addr: addr, PoolSize: clients, MinIdleConns: clients})
		defer rdb.Close()
		if err := releaseScript.Load(ctx, rdb).Err(); err != nil {
			return runResult{}, err
		}
		seed := rand.Uint64()
		return closedLoop(ctx, clients, dur, func(ctx context.Context, w, i int) error {
			key := "pgfence-bench:hot"
			if !hot {
				key = "pgfence-bench:lock:" + strconv.Itoa(w)
			}
			val := strconv.FormatUint(seed, 36) + ":" + strconv.Itoa(w) + ":" + strconv.Itoa(i)
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

const scenP2 = "P2 Redis SET NX PX + Lua release"

// startRedisPeer starts redis-server for P2 when wanted and installed;
// otherwise it records why P2 is not measured. stop is never nil.
func (b *bench) startRedisPeer(ctx context.Context) (stop func()) {
	switch {
	case !b.want("P2"):
		return func() {}
	case b.cfg.noRedis:
		b.add(notMeasured(scenP2, "", 0, "cycles/s", "disabled with --no-redis"))
		return func() {}
	}
	c, addr, version, err := startRedis(ctx)
	if err != nil {
		b.add(notMeasured(scenP2, "", 0, "cycles/s", "redis: "+err.Error()+" (apt-get install redis-server)"))
		return func() {}
	}
	b.redisAddr = addr
	b.mach.Redis = version
	b.progress("%s listening on %s", version, addr)
	return c.stop
}

// p2Variant is redisVariant with the rows it adds.
func (b *bench) p2Variant(hot bool, clients int) variant {
	v := redisVariant(b.redisAddr, hot, clients)
	k := keyDistinct
	if hot {
		k = keyHot
	}
	v.emit = func(s series) {
		b.add(rateRow(scenP2, v.name, clients, "cycles/s", s))
		b.keep(keyP2, k, clients, s.rates)
		if clients == 1 && !hot {
			b.memRow("P2 Redis lock+release", s)
		}
	}
	return v
}
