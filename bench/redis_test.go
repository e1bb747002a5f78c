package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// TestStartRedisPersistence starts both Redis configurations of the bench
// and checks what each server reports: P2 without persistence, P3 with the
// AOF fsynced on every write (and a lock written to it).
func TestStartRedisPersistence(t *testing.T) {
	if _, err := lookBin("redis-server"); err != nil {
		t.Skip("redis-server not installed: P2 and P3 say not measured in the bench (apt-get install redis-server)")
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for _, durable := range []bool{false, true} {
		c, addr, _, persistence, err := startRedis(ctx, durable)
		if err != nil {
			t.Fatalf("durable=%t: %v", durable, err)
		}
		want := "appendonly no, save \"\""
		if durable {
			want = "appendonly yes, appendfsync always, save \"\""
		}
		if persistence != want {
			t.Errorf("durable=%t: persistence %q, want %q", durable, persistence, want)
		}
		rdb := redis.NewClient(&redis.Options{Addr: addr})
		if err := rdb.Set(ctx, "pgfence-bench:probe", "1", time.Minute).Err(); err != nil {
			t.Errorf("durable=%t: SET: %v", durable, err)
		}
		info, err := rdb.Info(ctx, "persistence").Result()
		if err != nil {
			t.Errorf("durable=%t: INFO: %v", durable, err)
		}
		if on := strings.Contains(info, "aof_enabled:1"); on != durable {
			t.Errorf("durable=%t: INFO persistence says aof_enabled:1 = %t", durable, on)
		}
		_ = rdb.Close()
		c.stop()
	}
}
