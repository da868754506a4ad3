package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/urfave/cli/v2"

	"github.com/receiptledger/reconciler/gateway"
	"github.com/receiptledger/reconciler/ledger"
)

// callThrough: `gateway`, which plans and moves receipts as the agents and
// keeps their responses for replays.
var callThrough = access{"plan and move receipts and keep the gateway's responses",
	"reconciler_agent",
	`has_table_privilege('reconciler.receipts', 'SELECT') AND has_column_privilege('reconciler.receipts', 'state', 'UPDATE')
	 AND has_table_privilege('reconciler.gateway_responses', 'INSERT')`}

func gatewayCommand() *cli.Command {
	return &cli.Command{
		Name:  "gateway",
		Usage: "serve the receipt gateway: agents in any language call APIs through it and get the ledger's protection",
		Description: "A reverse proxy for side effects, configured by a routes file. Each side-effecting call " +
			"is planned, recorded submitted and forwarded through the ledger; the answer carries Receipt-Id and " +
			"Receipt-State, or a problem document (RFC 9457) saying what the agent may do next. " +
			"GET /receipts/{id}?wait=30s waits for a settlement; /openapi.json documents the endpoints. " +
			"Prometheus metrics are served on --metrics-addr only, never on the agents' listener.",
		Flags: []cli.Flag{
			databaseURLFlag(),
			&cli.StringFlag{Name: "config", Required: true, EnvVars: []string{"RECONCILER_GATEWAY_CONFIG"},
				Usage: "routes file (YAML): agents, their tokens, routes, upstream credentials"},
			&cli.StringFlag{Name: "listen", EnvVars: []string{"RECONCILER_GATEWAY_LISTEN"},
				Usage: "address to listen on (default: the file's listen, else " + gateway.DefaultListen + ")"},
			&cli.StringFlag{Name: "metrics-addr", EnvVars: []string{"RECONCILER_GATEWAY_METRICS_ADDR"},
				Usage: "serve /metrics on this address (e.g. 127.0.0.1:9091), apart from the agents' listener: " +
					"they show every agent's activity per route and take no token; empty: off"},
			&cli.DurationFlag{Name: "grace-period", Value: 20 * time.Second, EnvVars: []string{"RECONCILER_GRACE_PERIOD"},
				Usage: "on SIGTERM/SIGINT, how long calls in flight may finish"},
			&cli.StringFlag{Name: "log-level", Value: "info", EnvVars: []string{"RECONCILER_LOG_LEVEL"},
				Usage: "debug, info, warn or error"},
			requireSyncFlag(),
		},
		Action: gatewayAction,
	}
}

func gatewayAction(c *cli.Context) error {
	ctx := c.Context
	var level slog.Level
	if err := level.UnmarshalText([]byte(c.String("log-level"))); err != nil {
		return cli.Exit(fmt.Sprintf("gateway: --log-level: %v", err), 2)
	}
	logger := slog.New(slog.NewJSONHandler(jsonLines{c.App.ErrWriter}, &slog.HandlerOptions{Level: level}))
	cfg, err := gateway.LoadConfig(c.String("config"), os.LookupEnv)
	if err != nil {
		return cli.Exit(fmt.Sprintf("gateway: %v", err), 1)
	}
	if l := c.String("listen"); l != "" {
		cfg.Listen = l
	}
	// A pool that watches the server's warnings: a submit whose wait for
	// a synchronous standby was canceled is never followed by a send.
	db, err := openLedgerPool(ctx, "gateway", c.String("database-url"))
	if err != nil {
		return err
	}
	defer db.Close()
	if err := checkLedger(ctx, "gateway", db, callThrough); err != nil {
		return err
	}
	client, err := ledger.New(db, "agent:gateway")
	if err != nil {
		return cli.Exit(fmt.Sprintf("gateway: %v", err), 1)
	}
	// ?wait= and the webhook deliverer share the client's LISTEN
	// connection: its failures are the gateway's to report.
	client = client.WithLogger(logger)
	if client, err = client.SecretKeyFromEnv(os.Getenv); err != nil {
		return cli.Exit(fmt.Sprintf("gateway: %v", err), 1)
	}
	require := c.Bool("require-synchronous-standby")
	if require {
		client = client.RequireSynchronousStandby(ledger.DefaultDurabilityRecheck)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	health := newLedgerHealth(db, reg, logger, require)
	health.check(ctx)
	go health.run(ctx)
	g := gateway.New(client, cfg, gateway.Options{Logger: logger, Metrics: gateway.NewMetrics(reg)})
	if addr := c.String("metrics-addr"); addr != "" {
		srv, err := serveGatewayMetrics(addr, reg)
		if err != nil {
			return cli.Exit(fmt.Sprintf("gateway: --metrics-addr: %v", err), 1)
		}
		defer func() { _ = srv.Close() }()
		logger.Info("gateway metrics served", "addr", addr)
	}
	ready := gatewayReadyz(health, g)
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/readyz" && r.Method == http.MethodGet {
			ready(w, r)
			return
		}
		g.ServeHTTP(w, r)
	})
	l, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return cli.Exit(fmt.Sprintf("gateway: listen: %v", err), 1)
	}
	if host, _, _ := net.SplitHostPort(l.Addr().String()); !net.ParseIP(host).IsLoopback() {
		logger.Warn("the gateway listens beyond this host: every agent that can reach it needs only a token", "addr", l.Addr().String())
	}
	logger.Info("gateway started", "addr", l.Addr().String(), "routes", len(cfg.Routes), "agents", len(cfg.Agents))
	if err := g.Run(ctx, l, handler, c.Duration("grace-period")); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return cli.Exit(fmt.Sprintf("gateway: %v", err), 1)
	}
	logger.Info("gateway stopped")
	return nil
}

// serveGatewayMetrics serves reg's metrics at GET /metrics on addr, a
// listener of their own: they name every route and count every agent's
// calls, and take no token, so they stay off the agents' listener.
func serveGatewayMetrics(addr string, reg *prometheus.Registry) (*http.Server, error) {
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(l) }()
	return srv, nil
}

// gatewayReadiness is the body of the gateway's /readyz.
type gatewayReadiness struct {
	Status string `json:"status"`
	// Reason says why the gateway is not ready.
	Reason     string          `json:"reason,omitempty"`
	Durability *durabilityJSON `json:"durability,omitempty"`
	// UnrecordedOutcomes counts the calls whose outcome the gateway keeps
	// because the database did not take it yet (their receipts are
	// submitted until it does).
	UnrecordedOutcomes int `json:"unrecorded_outcomes"`
}

// gatewayReadyz answers GET /readyz: 200 while the gateway can record
// receipts (the database answers and takes its writes, the schema is
// current, and with --require-synchronous-standby a synchronous standby
// confirms commits), 503 otherwise; a JSON body either way. It answers
// from the last background check, without a round trip.
func gatewayReadyz(h *ledgerHealth, g *gateway.Gateway) http.HandlerFunc {
	return func(w http.ResponseWriter, _ *http.Request) {
		why, d := h.notReady()
		body := gatewayReadiness{Status: "ready", Reason: why, Durability: d, UnrecordedOutcomes: g.Unrecorded()}
		status := http.StatusOK
		if why != "" {
			body.Status, status = "not ready", http.StatusServiceUnavailable
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Cache-Control", "no-store")
		w.WriteHeader(status)
		_ = json.NewEncoder(w).Encode(body)
	}
}
