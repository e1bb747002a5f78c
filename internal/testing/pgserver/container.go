package pgserver

import (
	"context"
	"fmt"
	"io"
	"time"

	"github.com/testcontainers/testcontainers-go"
	tcpostgres "github.com/testcontainers/testcontainers-go/modules/postgres"
)

// ContainerImage is the image used when a Docker engine answers.
const ContainerImage = "postgres:15-alpine"

// DockerAvailable reports whether a Docker engine answers, and why not.
func DockerAvailable(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	var err error
	func() {
		// testcontainers may panic when no Docker host can be resolved at all.
		defer func() {
			if r := recover(); r != nil {
				err = fmt.Errorf("docker provider: %v", r)
			}
		}()
		var p *testcontainers.DockerProvider
		p, err = testcontainers.NewDockerProvider()
		if err != nil {
			return
		}
		err = p.Health(ctx)
	}()
	if err != nil {
		return fmt.Errorf("no Docker engine answers: %w", err)
	}
	return nil
}

func startContainer(ctx context.Context, logw io.Writer) (*Server, error) {
	if err := DockerAvailable(ctx); err != nil {
		return nil, err
	}
	fmt.Fprintf(logw, "pgserver: starting %s with testcontainers\n", ContainerImage)
	c, err := tcpostgres.Run(ctx, ContainerImage,
		tcpostgres.WithDatabase("postgres"),
		tcpostgres.WithUsername("postgres"),
		tcpostgres.WithPassword("postgres"),
		tcpostgres.BasicWaitStrategies(),
	)
	if err != nil {
		if c != nil {
			_ = c.Terminate(context.Background())
		}
		return nil, fmt.Errorf("start container: %w", err)
	}
	dsn, err := c.ConnectionString(ctx, "sslmode=disable")
	if err != nil {
		_ = c.Terminate(context.Background())
		return nil, err
	}
	return &Server{
		Kind: KindTestcontainers,
		DSN:  dsn,
		terminate: func(ctx context.Context) error {
			return c.Terminate(ctx)
		},
	}, nil
}
