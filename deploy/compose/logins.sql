-- Login roles of the compose stack, one per process, each in a group role
-- of docs/roles.sql (apply that file first). Demo passwords: this file is
-- for the local compose stack only; never reuse them.
-- Idempotent: `docker compose up` runs it on every start.
DO $$
DECLARE
    l record;
BEGIN
    FOR l IN SELECT * FROM (VALUES
            ('compose_worker',   'worker',   'reconciler_worker'),
            ('compose_agent',    'agent',    'reconciler_agent'),
            ('compose_reviewer', 'reviewer', 'reconciler_reviewer')) AS v(name, password, grp)
    LOOP
        IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = l.name) THEN
            EXECUTE format('CREATE ROLE %I LOGIN PASSWORD %L', l.name, l.password);
        END IF;
        EXECUTE format('GRANT %I TO %I', l.grp, l.name);
    END LOOP;
END
$$;
