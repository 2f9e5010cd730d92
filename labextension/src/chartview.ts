/**
 * A chart of the side panel, larger, in a main-area tab of its own (as jupyterlab-nvdashboard opens its
 * charts): it follows the poll it shares with the panel, so it stays live while the tab is shown.
 * Hooks for tests: the content has class `jp-Overmind-chartView` and `data-chart` (its kind).
 */

import { MainAreaWidget } from '@jupyterlab/apputils';
import { LabIcon } from '@jupyterlab/ui-components';
import { Message } from '@lumino/messaging';
import { Widget } from '@lumino/widgets';

import { chart, CHART_TITLES, ChartKind } from './charts';
import { h, prose } from './dom';
import { OvermindModel } from './model';

/** The content of a chart's tab: the chart of the latest state, redrawn after every poll. */
export class OvermindChartView extends Widget {
  constructor(model: OvermindModel, kind: ChartKind) {
    super();
    this.addClass('jp-Overmind');
    this.addClass('jp-Overmind-chartView');
    this.node.dataset.chart = kind;
    this._model = model;
    this._kind = kind;
    model.changed.connect(this._update, this);
    this._update();
  }

  get kind(): ChartKind {
    return this._kind;
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this._model.changed.disconnect(this._update, this);
    super.dispose();
  }

  protected onAfterShow(msg: Message): void {
    super.onAfterShow(msg);
    void this._model.refresh();
  }

  private _update(): void {
    const state = this._model.state;
    const samples = this._model.unitSamples.length;
    const signature = JSON.stringify([this._model.view, samples]);
    if (signature === this._signature) {
      return;
    }
    this._signature = signature;
    const view = this._model.view;
    const drawn = state && chart(this._kind, state, this._model.unitSamples);
    this.node.replaceChildren(
      drawn ||
        h(
          'p',
          { class: 'jp-Overmind-hint', 'data-testid': 'overmind-chart-empty' },
          ...prose(
            view.state === 'down'
              ? 'No overmind daemon is running: the chart shows once a notebook runs `%overmind on`.'
              : view.state === 'error'
                ? view.message
                : state
                  ? 'No GPU is known to the daemon yet.'
                  : 'Asking the server…'
          )
        )
    );
  }

  private _model: OvermindModel;
  private _kind: ChartKind;
  private _signature = '';
}

/** The main-area widget of chart `kind`, titled and iconed as the panel's. */
export function chartTab(model: OvermindModel, kind: ChartKind, icon: LabIcon): MainAreaWidget<OvermindChartView> {
  const content = new OvermindChartView(model, kind);
  const widget = new MainAreaWidget({ content });
  widget.id = `overmind-chart-${kind}`;
  widget.title.label = `Overmind: ${CHART_TITLES[kind]}`;
  widget.title.icon = icon;
  widget.title.closable = true;
  return widget;
}
