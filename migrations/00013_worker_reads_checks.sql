-- The worker reads the checks it wrote (readback_checks), where the roles of
-- docs/roles.sql are in use.
--
-- A write of checks whose commit outcome is unknown (RecordChecksAgain,
-- CompleteAgain) and every settlement that writes a check the recorder
-- could not confirm first probe readback_checks for the same check, so as
-- not to record one read twice. The worker could append checks but not read
-- them, so under the roles such a write failed with permission denied
-- (and its outcome was kept and retried, holding its lease, until a human
-- looked). Reading them discloses nothing a worker did not write itself.

-- +goose Up
-- +goose StatementBegin
DO $$
BEGIN
    IF to_regrole('reconciler_worker') IS NOT NULL THEN
        GRANT SELECT ON reconciler.readback_checks TO reconciler_worker;
    END IF;
END
$$;
-- +goose StatementEnd

-- +goose Down
-- +goose StatementBegin
DO $$
BEGIN
    IF to_regrole('reconciler_worker') IS NOT NULL THEN
        REVOKE SELECT ON reconciler.readback_checks FROM reconciler_worker;
    END IF;
END
$$;
-- +goose StatementEnd
