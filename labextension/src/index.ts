/**
 * overmind-jupyter: the side panel of overmind_jupyter in JupyterLab's left area.
 */

import {
  ILayoutRestorer,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { ICommandPalette } from '@jupyterlab/apputils';
import { LabIcon } from '@jupyterlab/ui-components';

import overmindSvg from '../style/icons/overmind.svg';
import { OvermindPanel } from './panel';

export const overmindIcon = new LabIcon({
  name: 'overmind-jupyter:overmind',
  svgstr: overmindSvg
});

const PANEL_ID = 'overmind-panel';

namespace CommandIDs {
  export const open = 'overmind:open-panel';
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'overmind-jupyter:panel',
  description:
    'The overmind side panel: models cached by the per-user daemon, GPU units, kernels and fallbacks.',
  autoStart: true,
  optional: [ILayoutRestorer, ICommandPalette],
  activate: (
    app: JupyterFrontEnd,
    restorer: ILayoutRestorer | null,
    palette: ICommandPalette | null
  ) => {
    const panel = new OvermindPanel({
      serverSettings: app.serviceManager.serverSettings
    });
    panel.id = PANEL_ID;
    panel.title.icon = overmindIcon;
    panel.title.caption = 'Overmind: cached models';
    app.shell.add(panel, 'left', { rank: 650 });
    if (restorer) {
      restorer.add(panel, PANEL_ID);
    }
    app.commands.addCommand(CommandIDs.open, {
      label: 'Show the Overmind Panel',
      caption: 'Models cached by the overmind daemon',
      execute: () => app.shell.activateById(PANEL_ID)
    });
    if (palette) {
      palette.addItem({ command: CommandIDs.open, category: 'Overmind' });
    }
  }
};

export default plugin;
