package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/urfave/cli/v2"

	"github.com/receiptledger/reconciler/reviewui"
)

func uiCommand() *cli.Command {
	return &cli.Command{
		Name:  "ui",
		Usage: "serve the review queue in a browser: list, inspect, resolve and requeue held receipts",
		Description: "Run it under a database login in reconciler_reviewer (docs/roles.sql): the database refuses " +
			"what that role may not do. Reviewers are known either from a header an authenticating proxy sets " +
			"(--trusted-user-header, accepted only from --trusted-proxy addresses) or from their own tokens " +
			"(--tokens-file, one \"NAME TOKEN\" a line). See docs/review-ui.md.",
		Flags: []cli.Flag{
			databaseURLFlag(),
			&cli.StringFlag{Name: "listen", Value: reviewui.DefaultListen, EnvVars: []string{"RECONCILER_UI_LISTEN"},
				Usage: "address to listen on"},
			&cli.StringFlag{Name: "trusted-user-header", EnvVars: []string{"RECONCILER_UI_TRUSTED_USER_HEADER"},
				Usage: "header naming the reviewer, set by an authenticating proxy (e.g. X-Forwarded-User)"},
			&cli.StringSliceFlag{Name: "trusted-proxy", EnvVars: []string{"RECONCILER_UI_TRUSTED_PROXY"},
				Usage: "address or CIDR of the proxy whose --trusted-user-header is believed (repeat, or comma-separate)"},
			&cli.StringFlag{Name: "tokens-file", EnvVars: []string{"RECONCILER_UI_TOKENS_FILE"},
				Usage: "file of reviewers' tokens, one \"NAME TOKEN\" a line, when no proxy signs reviewers in"},
			&cli.BoolFlag{Name: "secure-cookies", EnvVars: []string{"RECONCILER_UI_SECURE_COOKIES"},
				Usage: "mark the session cookie Secure (the page is reached over HTTPS)"},
			&cli.DurationFlag{Name: "stale-planned-after", Value: time.Hour, EnvVars: []string{"RECONCILER_STALE_PLANNED_AFTER"},
				Usage: "planned receipts older than this count as stale on the summary bar"},
			&cli.DurationFlag{Name: "orphan-timeout", Value: 5 * time.Minute, EnvVars: []string{"RECONCILER_ORPHAN_TIMEOUT"},
				Usage: "submitted receipts older than this count as orphans on the summary bar"},
			&cli.StringFlag{Name: "log-level", Value: "info", EnvVars: []string{"RECONCILER_LOG_LEVEL"},
				Usage: "debug, info, warn or error"},
		},
		Action: uiAction,
	}
}

// uiIdentifier builds the identity source the flags name: exactly one of a
// trusted header (with its proxies) and a tokens file.
func uiIdentifier(c *cli.Context) (reviewui.Identifier, error) {
	header, tokens, proxies := c.String("trusted-user-header"), c.String("tokens-file"), c.StringSlice("trusted-proxy")
	switch {
	case header != "" && tokens != "":
		return nil, cli.Exit("ui: give --trusted-user-header or --tokens-file, not both", 2)
	case header != "":
		id, err := reviewui.NewTrustedHeader(header, proxies)
		if err != nil {
			return nil, cli.Exit(fmt.Sprintf("ui: %v", err), 2)
		}
		return id, nil
	case len(proxies) > 0:
		return nil, cli.Exit("ui: --trusted-proxy needs --trusted-user-header", 2)
	case tokens != "":
		id, err := reviewui.LoadTokens(tokens)
		if err != nil {
			return nil, cli.Exit(fmt.Sprintf("ui: %v", err), 1)
		}
		return id, nil
	}
	return nil, cli.Exit("ui: say how reviewers are known: --trusted-user-header with --trusted-proxy, or --tokens-file", 2)
}

func uiAction(c *cli.Context) error {
	ctx := c.Context
	var level slog.Level
	if err := level.UnmarshalText([]byte(c.String("log-level"))); err != nil {
		return cli.Exit(fmt.Sprintf("ui: --log-level: %v", err), 2)
	}
	logger := slog.New(slog.NewJSONHandler(jsonLines{c.App.ErrWriter}, &slog.HandlerOptions{Level: level}))
	id, err := uiIdentifier(c)
	if err != nil {
		return err
	}
	db, err := pgxpool.New(ctx, c.String("database-url"))
	if err != nil {
		return cli.Exit(fmt.Sprintf("ui: database: %v", err), 1)
	}
	defer db.Close()
	// Reading is checked here; deciding is left to the database, which
	// refuses a login outside reconciler_reviewer on the page itself.
	if err := checkLedger(ctx, "ui", db, readLedger); err != nil {
		return err
	}
	srv, err := reviewui.New(reviewui.Config{Pool: db, Identifier: id, Logger: logger,
		StalePlanned: c.Duration("stale-planned-after"), OrphanTimeout: c.Duration("orphan-timeout"),
		SecureCookies: c.Bool("secure-cookies")})
	if err != nil {
		return cli.Exit(fmt.Sprintf("ui: %v", err), 1)
	}
	l, err := net.Listen("tcp", c.String("listen"))
	if err != nil {
		return cli.Exit(fmt.Sprintf("ui: listen: %v", err), 1)
	}
	if host, _, _ := net.SplitHostPort(l.Addr().String()); !net.ParseIP(host).IsLoopback() {
		logger.Warn("the review page listens beyond this host: put it behind TLS", "addr", l.Addr().String())
	}
	hs := &http.Server{Handler: srv, ReadHeaderTimeout: 10 * time.Second, ReadTimeout: 30 * time.Second,
		WriteTimeout: 30 * time.Second, IdleTimeout: 2 * time.Minute, ErrorLog: slog.NewLogLogger(logger.Handler(), slog.LevelWarn)}
	done := make(chan struct{})
	go func() {
		defer close(done)
		<-ctx.Done()
		shut, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = hs.Shutdown(shut)
	}()
	logger.Info("ui started", "addr", l.Addr().String())
	if err := hs.Serve(l); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return cli.Exit(fmt.Sprintf("ui: %v", err), 1)
	}
	<-done
	logger.Info("ui stopped")
	return nil
}
